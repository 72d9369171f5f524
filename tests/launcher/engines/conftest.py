"""Engine adapter tests: pure planning, argv and read-back against stand-ins and real log files;
the engines' own parsers only when OMNI_DP_PARSERS_PYTHON names their venv's python."""
