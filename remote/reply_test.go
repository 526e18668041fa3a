package remote

import (
	"errors"
	"testing"
	"time"
)

func TestParseReply(t *testing.T) {
	ok := []any{int64(1), int64(250000), int64(0), int64(750000), int64(0), int64(1764504000000000)}
	got, err := parseReply(ok)
	want := Result{Allowed: true, Level: 250000, ResetAfter: 750 * time.Millisecond, Now: 1764504000000000}
	if err != nil || got != want {
		t.Errorf("parseReply(%v) = %+v, %v; want %+v", ok, got, err, want)
	}
	for _, bad := range []any{
		nil, "OK", int64(1), []any{}, []any{int64(1)},
		[]any{"1", int64(0), int64(0), int64(0), int64(0), int64(0)},
		[]any{int64(2), int64(0), int64(0), int64(0), int64(0), int64(0)},
		[]any{int64(1), int64(-1), int64(0), int64(0), int64(0), int64(0)},
		[]any{int64(1), int64(0), int64(0), int64(0), int64(0), int64(0), int64(0)},
	} {
		if res, err := parseReply(bad); !errors.Is(err, ErrReply) {
			t.Errorf("parseReply(%#v) = %+v, %v; want ErrReply", bad, res, err)
		}
	}
}

// FuzzParseReply feeds replies of any shape built from the fuzzer's numbers:
// parseReply returns a Result or ErrReply, never panics.
func FuzzParseReply(f *testing.F) {
	f.Add(uint8(6), int64(1), int64(250000), int64(0), int64(750000), int64(0), int64(1764504000000000))
	f.Add(uint8(6), int64(0), int64(0), int64(100000), int64(1000000), int64(1), int64(1))
	f.Add(uint8(6), int64(0), int64(0), int64(-1), int64(1<<62), int64(0), int64(0))
	f.Add(uint8(3), int64(1), int64(2), int64(3), int64(4), int64(5), int64(6))
	f.Add(uint8(0x86), int64(1), int64(2), int64(3), int64(4), int64(5), int64(6))
	f.Fuzz(func(t *testing.T, shape uint8, a, b, c, d, e, g int64) {
		nums := []int64{a, b, c, d, e, g}
		n := int(shape & 7)
		vals := make([]any, 0, n)
		for i := 0; i < n; i++ {
			var v any = nums[i%len(nums)]
			if shape&0x80 != 0 && i == 0 {
				v = "1" // a string where an integer belongs
			}
			vals = append(vals, v)
		}
		res, err := parseReply(vals)
		if err != nil {
			if !errors.Is(err, ErrReply) {
				t.Fatalf("parseReply(%v) error %v does not wrap ErrReply", vals, err)
			}
			return
		}
		if res.Level < 0 || res.ResetAfter < 0 {
			t.Fatalf("parseReply(%v) = %+v: negative level or reset", vals, res)
		}
	})
}
