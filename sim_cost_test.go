package hybridlimit

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
)

var simCost = flag.String("sim.cost", "", "simulator: append each seed's CPU time and what it drew to this file, a tab-separated line a seed (with GOMAXPROCS=1, one process runs the seeds one after another and the times are the seeds' own)")

var simCostMu sync.Mutex // orders a process's lines

// simCostHeader names the columns of -sim.cost's lines.
const simCostHeader = "seed\tcpu_ms\tcluster\tinstances\tslots\tevents\theartbeat\tduration\twaiters\tcalls\tfeatures\n"

// startSimCost empties -sim.cost's file and writes its header, once, before
// any seed runs: the processes that run the seeds then only append.
func startSimCost() error {
	return os.WriteFile(*simCost, []byte(simCostHeader), 0o644)
}

// writeSimCost appends seed's line to -sim.cost's file: the process's CPU
// time (user and system) over the seed, cpu0 being it before, and what the
// seed drew that its cost depends on. Several processes append to one file:
// each line is one write.
func writeSimCost(s schedule, cpu0 time.Duration, calls int) error {
	cpu := processCPU() - cpu0
	hb := s.Heartbeat
	if hb == 0 {
		hb = DefaultHeartbeat
	}
	line := fmt.Sprintf("%d\t%.1f\t%t\t%d\t%d\t%d\t%v\t%v\t%d\t%d\t%s\n",
		s.Seed, float64(cpu)/1e6, s.Cluster != nil, s.Instances, s.Slots, len(s.Events), hb, s.Duration, s.Waiters, calls,
		strings.Join(s.features(), ","))
	simCostMu.Lock()
	defer simCostMu.Unlock()
	f, err := os.OpenFile(*simCost, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(line)
	return errors.Join(err, f.Close())
}
