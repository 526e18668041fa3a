package remote

import (
	"context"
	"strings"
	"testing"

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

// TestOnceKeySlot: a charge's Once key lives in its bucket's Cluster slot.
func TestOnceKeySlot(t *testing.T) {
	for _, key := range []string{"k", "hybridlimit:user:1", "{tag}rest", "a{b", "pre{}post", "x{y}z{w}", "a}b"} {
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
	}
}
