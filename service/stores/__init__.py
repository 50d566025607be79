"""What replicas share through Redis (or keep in this process without it): audio cache, lexicon, saved voices and
prompt analyses, rate-limit counters; one Redis client factory."""
