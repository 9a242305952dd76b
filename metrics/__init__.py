"""mooncake-lookout: the metric catalogue and its sinks."""
