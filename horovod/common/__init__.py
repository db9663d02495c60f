"""``horovod.common`` for scripts written against Horovod: the exceptions they import."""
