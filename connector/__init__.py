"""mooncake-lookout: the lookup client, transports, server and vLLM connector."""
