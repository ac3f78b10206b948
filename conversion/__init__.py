"""Converting, distilling, fine-tuning and publishing delta-attention models."""
