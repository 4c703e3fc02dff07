"""Measurement on top of the decoder and the envs: benchmark, cost profiles, engine tables and exports, reports, plots."""
