"""The inputs: dataset manifests (one YAML spec per benchmark), their annotation parsers, and
generated videos for tests and the quickstart."""
