"""The HTTP side: the OpenAI-compatible server, the data-parallel router and its replica processes, the
protocol's request bodies and what the apps share."""
