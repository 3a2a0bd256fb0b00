"""A fleet in a discrete-event model, calibrated from the engine's own step costs: capacity beyond this machine."""
