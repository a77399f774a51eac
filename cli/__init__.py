"""The ``zoo`` command line: one parser over the commands of the packages below it (``serving``, ``training``)."""
