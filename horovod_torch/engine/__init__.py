"""The engine as Python sees it: loading the C++ extension (extension), finding the
store and secret under a foreign launcher (rendezvous), and init, shutdown and the
queries (basics)."""
