"""Process lifecycle: launching and ending process groups, stop signals, failure reports and the run's
logging set-up. Imports only the config; every other coordinator layer may import it."""
