"""`localpd quantize`: calibrate a model on a text, quantize it once and save it."""
