"""Model families and the registry by HF `architectures`."""
