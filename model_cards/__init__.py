"""Model card templates (Jinja, rendered with `huggingface_hub.ModelCard.from_template`); data only."""
