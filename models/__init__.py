"""Shared data models of borrowd: the budget record, observations, protocols, the simulator
(`models.sim`) and plant identification (`models.plant`)."""
