"""Helpers of the launcher that scripts written for Horovod import
(``horovod.runner.util.threads``)."""
