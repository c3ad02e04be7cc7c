"""The round driver over its transports (in-process here, Flower in `fedvl.flower`) and the
recorder of the run directory. Above the methods: methods never import it."""
