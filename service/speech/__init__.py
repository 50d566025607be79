"""Speech: requests, the jobs that synthesize them and the service that admits, prepares and runs them."""
