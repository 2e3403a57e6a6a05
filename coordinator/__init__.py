"""The coordinator: public Generation service, the round loop, routing."""
