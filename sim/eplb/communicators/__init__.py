"""EPLB communicator lifecycle strategies: the code under test."""
