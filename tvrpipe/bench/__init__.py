"""Every benchmark (``tvrpipe bench ...``): extraction, head evaluation and training, finetune,
convergence. Each reports ratios measured in one run and writes its figures as JSON."""
