"""Converting a checkpoint: load the source, plan which layers become delta attention, map the weights,
initialise and calibrate the new parameters, and save (`pipeline.convert`)."""
