"""Publishing: model cards rendered from `model_cards/`, and `push` to the Hub."""
