"""What a trained run gives back: its model read from any layout, exported to Hugging Face, sampled."""
