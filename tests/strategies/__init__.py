"""User strategies for tests, loadable as ``tests.strategies.<module>:create`` (like ``--strategy pkg.mod:factory``)."""
