"""`python -m ds_cluster.cli` is `ds-cluster`."""
import sys

from ds_cluster.cli import main

sys.exit(main())
