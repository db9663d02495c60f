"""The collectives on tensors: naming, submitting and waiting (submit), process sets,
the six collectives and their variants (ops), Adasum, compression, sparse allreduce,
and Horovod's ``mpi_ops`` names for them."""
