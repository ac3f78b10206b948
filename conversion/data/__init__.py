"""Text for calibration, training and evaluation: the offline assets, text and chat datasets, token windows."""
