"""Vision beside the text decoder: image preprocessing in numpy and Pillow (`image_processing`), the SigLIP tower
(`siglip`), Gemma 3's projector and image-text forward (`gemma3`), and their config and weights (`hf`)."""
