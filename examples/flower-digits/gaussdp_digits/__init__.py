"""gaussdp-digits: client-level DP-FedAvg on the scikit-learn digits, with gaussdp on Flower."""
