package remote

import (
	"context"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// TestChargeOnce: on redis-server, a charge sent twice under one Once
// takes its units once; the second answers Again and takes nothing, on a
// plain key and on a key with a hash tag, in a pipeline too.
func TestChargeOnce(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	p := NewPipe(c, 2, nil)
	defer p.Close()
	ctx := context.Background()
	lim, err := NewLimit(10, 100)
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"plain", "{user:7}:k"} {
		charge := Request{Key: key, Limit: lim, Units: lim.Units(30), Charge: true, Once: "a1"}
		first, err := p.Do(ctx, charge)
		if err != nil || first.Again || !first.Allowed {
			t.Fatalf("%s: first charge %+v, %v", key, first, err)
		}
		again, err := p.Do(ctx, charge)
		if err != nil || !again.Again {
			t.Fatalf("%s: second charge %+v, %v; want Again", key, again, err)
		}
		if tokens := lim.Tokens(again.Level); tokens < 70 || tokens > 71 {
			t.Errorf("%s: %.2f tokens after the charge sent twice; want 70, the refill aside", key, tokens)
		}
		other := charge
		other.Once = "a2"
		if res, err := p.Do(ctx, other); err != nil || res.Again || lim.Tokens(res.Level) > 41 {
			t.Errorf("%s: a charge under another Once: %+v, %v; want it applied", key, res, err)
		}
	}
}

// TestOnceKeySlot: a charge's Once key lives in its bucket's Cluster slot,
// and starts with the bucket's key (so with the limiter's Prefix) unless
// the key has a '{' that no '}' closes.
func TestOnceKeySlot(t *testing.T) {
	for _, key := range []string{"k", "hybridlimit:user:1", "{tag}rest", "a{b", "pre{}post", "x{y}z{w}", "a}b", "hybridlimit:{t}x"} {
		once := OnceKey(key, "id")
		if once == "" {
			if !strings.Contains(key, "}") {
				t.Errorf("OnceKey(%q) = \"\"", key)
			}
			continue
		}
		if Slot(once) != Slot(key) {
			t.Errorf("OnceKey(%q) = %q: slot %d, the key's %d", key, once, Slot(once), Slot(key))
		}
		if open := strings.Index(key, "{"); !strings.HasPrefix(once, key) && (open < 0 || strings.Contains(key[open:], "}")) {
			t.Errorf("OnceKey(%q) = %q; want it under the key", key, once)
		}
	}
}

// TestOnceKeyUnderACL: on redis-server, a user whose ACL allows only keys
// under the limiter's Prefix (~hybridlimit:*) can charge under a Once: the
// charge's name is under the Prefix too. Named {key}:once:..., Redis
// refused every such charge (NOPERM), and what an instance spent while
// Redis was away was never charged.
func TestOnceKeyUnderACL(t *testing.T) {
	srv := redistest.Start(t)
	srv.Do(t, "ACL", "SETUSER", "limiter", "on", ">pw", "~hybridlimit:*", "+@all")
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: "limiter", Password: "pw"})
	defer c.Close()
	p := NewPipe(c, 0, nil)
	defer p.Close()
	lim := mustLimit(t, 10, 10)
	for _, key := range []string{"hybridlimit:k", "hybridlimit:{t}k"} {
		res, err := p.Do(context.Background(), Request{Key: key, Limit: lim, Units: lim.Units(3), Charge: true, Once: "c1"})
		if err != nil || !res.Allowed {
			t.Errorf("charge of %s under a Once = %+v, %v; want it applied", key, res, err)
		}
	}
}
