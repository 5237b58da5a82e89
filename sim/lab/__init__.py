"""The lab around the simulator: sweeps over seeds and faults (``sweep``, ``swarm``), where their runs execute
(``executors``), the results database (``resultsdb``), failure bundles and their shrinking (``bundle``, ``shrink``),
reports (``report``) and the strategy matrix (``matrix``).  The model they run is the rest of :mod:`sim`."""
