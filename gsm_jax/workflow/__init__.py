"""The GSM workflow: profile (step 1), evaluate, calibrate (step 4) and the evidence report."""
