"""`deepspeed.runtime`'s module paths that scripts and libraries import (see zero/)."""
