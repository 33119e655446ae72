"""Rewards: the functions a recipe names, served judges and reward models, and the guard that
runs them in workers with deadlines (:mod:`.computer`)."""
