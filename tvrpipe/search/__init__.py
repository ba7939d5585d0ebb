"""Search a feature store with a sentence: the two stages (an exact or FAISS first stage over pooled
embeddings, then the run's head on a shortlist), the query encoder, and the outputs (table, JSON,
CSV, an HTML page with thumbnails)."""
