"""The application's ingress deployment (``OpenAIIngress``): the HTTP and handle API, on each node, no GPU."""
