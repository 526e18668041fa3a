package simredis

import (
	"math"
	"strconv"
	"time"
)

// fleet is lua/fleet.lua: one heartbeat, reporting for window j in the
// hash at report, reading window i's in the hash at read and, if asked
// for, window i-1's at before ("": no third key). See the script for the
// arguments and the reply. Numbers are float64, as Lua's are. fleet
// requires that s.mu is held.
func (s *Server) fleet(at time.Time, report, read, before string, argv []string) any {
	return s.fleetAt(at, at, report, read, before, argv)
}

// fleetAt is fleet with the script's reading of TIME, clock, apart from
// the time keys are expired by, at: Redis expires keys by the time its
// script started, and TIME inside it reads the clock when it runs, later
// by as long as the server was held between the two (a few milliseconds on
// a loaded machine).
func (s *Server) fleetAt(clock, at time.Time, report, read, before string, argv []string) any {
	if len(argv) < 7 {
		return rerror("ERR Error running script: ARGV missing")
	}
	j, ok1 := number(argv[0])
	i, ok2 := number(argv[2])
	w, ok3 := number(argv[3])
	want, ok4 := number(argv[4])
	mi, ok5 := number(argv[5])
	mb, ok6 := number(argv[6])
	if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 || !ok6 || math.Mod(j, 1) != 0 || math.Mod(i, 1) != 0 || w < 1 || math.Mod(w, 1) != 0 ||
		math.Mod(want, 1) != 0 || want < 0 || want > 7 || want >= 2 && before == "" {
		return rerror("ERR hybridlimit fleet: bad arguments")
	}
	var now float64
	if len(argv) >= 8 {
		us, ok := number(argv[7])
		if !ok || us < 0 {
			return rerror("ERR hybridlimit fleet: bad time")
		}
		now = math.Floor(us / 1000)
	} else {
		us := clock.UnixMicro()
		now = float64(us/1e6)*1000 + math.Floor(float64(us%1e6)/1000)
	}
	r := math.Floor(now / w)

	taken := int64(0)
	if j >= r-2 && j <= r {
		add, err := strconv.ParseInt(argv[1], 10, 64)
		if err != nil {
			return rerror("ERR value is not an integer or out of range")
		}
		v, e := s.hash(at, report, true)
		if e != nil {
			return e
		}
		sum := hincrby(v, "#t", add)
		first := sum == add
		m, ok := "", false
		if !first {
			m, ok = hget(v, "#m")
		}
		if !ok {
			m = strconv.FormatInt(int64(math.Mod(now, 1023))+1, 10)
			hset(v, "#m", m)
		}
		if first {
			v.expire = time.UnixMilli(int64((j + 6) * w))
			if !v.expire.After(time.UnixMilli(at.UnixMilli())) {
				// PEXPIREAT at or before the server's clock (a window
				// read by a client clock ahead of it) deletes the key
				// at once, where a key merely past its time is expired
				// only once the clock is after it.
				delete(s.data, report)
			}
		}
		mark, _ := strconv.ParseInt(m, 10, 64)
		taken = 1 + mark
		s.replicate(report)
	}
	if i <= r-3 {
		v, e := s.hash(at, read, false)
		if e != nil {
			return e
		}
		sum, ok := hget(v, "#t")
		ticket := int64(0)
		if ok && (math.Mod(want, 2) == 1 || markOf(v) != mi) {
			ticket = hincrby(v, "#c", 1)
			s.replicate(read)
		}
		if math.Mod(want, 4) >= 2 && i >= r-4 {
			b, e := s.hash(at, before, false)
			if e != nil {
				return e
			}
			bsum, bok := hget(b, "#t")
			bticket := int64(0)
			if bok && (want >= 4 || markOf(b) != mb) {
				bticket = hincrby(b, "#c", 1)
				s.replicate(before)
			}
			return []any{int64(now), taken, orZero(sum, ok), ticket, orZero(bsum, bok), bticket}
		}
		if ok {
			return []any{int64(now), taken, sum, ticket}
		}
	}
	return []any{int64(now), taken, int64(0), int64(0)}
}

// markOf is v's mark, as the script reads it: tonumber(HMGET(...)[2] or 0).
func markOf(v *value) float64 {
	m, ok := hget(v, "#m")
	if !ok {
		return 0
	}
	f, err := strconv.ParseFloat(m, 64)
	if err != nil {
		return math.NaN() // tonumber's nil: equal to no mark
	}
	return f
}

// hset sets field to val in v, as HSET does.
func hset(v *value, field, val string) {
	for k := 0; k < len(v.fields); k += 2 {
		if v.fields[k] == field {
			v.fields[k+1] = val
			return
		}
	}
	v.fields = append(v.fields, field, val)
}

// orZero is a field's value as a script returns `HGET(...) or 0`.
func orZero(v string, ok bool) any {
	if ok {
		return v
	}
	return int64(0)
}

// hash returns the hash at key, nil if there is none and create is false;
// an error reply if key holds something else.
func (s *Server) hash(at time.Time, key string, create bool) (*value, any) {
	v := s.get(at, key)
	switch {
	case v == nil && create:
		v = &value{hash: true}
		s.data[key] = v
	case v != nil && !v.hash:
		return nil, rerror("WRONGTYPE Operation against a key holding the wrong kind of value")
	}
	return v, nil
}

// hget returns field's value in v, which may be nil.
func hget(v *value, field string) (string, bool) {
	if v == nil {
		return "", false
	}
	for k := 0; k < len(v.fields); k += 2 {
		if v.fields[k] == field {
			return v.fields[k+1], true
		}
	}
	return "", false
}

// hincrby adds n to field in v, as HINCRBY does, and returns the sum.
func hincrby(v *value, field string, n int64) int64 {
	for k := 0; k < len(v.fields); k += 2 {
		if v.fields[k] == field {
			cur, _ := strconv.ParseInt(v.fields[k+1], 10, 64)
			v.fields[k+1] = strconv.FormatInt(cur+n, 10)
			return cur + n
		}
	}
	v.fields = append(v.fields, field, strconv.FormatInt(n, 10))
	return n
}
