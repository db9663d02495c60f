"""Training built on the collectives: DistributedOptimizer (optimizer), sharded
optimizer state (sharded, sharded_recovery), broadcasting parameters and objects
(functions), SyncBatchNorm, and elastic training (elastic/)."""
