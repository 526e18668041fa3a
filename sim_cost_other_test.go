//go:build !unix

package hybridlimit

import "time"

// processCPU is not measured here: -sim.cost's times are 0.
func processCPU() time.Duration { return 0 }
