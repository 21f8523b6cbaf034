"""Fine-tuning methods as transforms of the parameter tree."""
