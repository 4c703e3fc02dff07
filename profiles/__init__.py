"""Package data: the committed cost profiles and acceptance traces, by machine key (`<key>/<draft>.json`) and
draft (`traces/<target>/<draft>.json`). Found through `specpilot.decoding.paths.find_artifact`."""
