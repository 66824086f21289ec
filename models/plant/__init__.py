"""Plant identification: how the batch token budget moves the interactive latency.

FOPDT and ARX fits by least squares, fit quality, recursive least squares for online
re-estimation, excitation design, and the frozen `PlantModel` saved as JSON.
"""
