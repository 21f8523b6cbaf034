"""jaxtune: plan, run and export fine-tuning of Llama-family language models in JAX."""
