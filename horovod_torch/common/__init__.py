"""The lowest layer, torch-free and extension-free (the launcher uses it too): errors,
the knobs (config) and what a launcher says (launch_env), the timeline reader, handles,
the elastic protocol's store keys and its worker side, Horovod's build variables and
util, the optional extras, and the demo data generator."""
