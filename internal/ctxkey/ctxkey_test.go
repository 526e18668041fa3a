package ctxkey

import "testing"

type user struct{ id string }

func (u *user) String() string { return u.id }

type names []string

func (n names) String() string { return n[0] }

func TestString(t *testing.T) {
	var anon *user
	var none names
	for _, c := range []struct {
		v    any
		key  string
		ok   bool
		name string
	}{
		{nil, "", true, "nil"},
		{"u1", "u1", true, "string"},
		{&user{"u2"}, "u2", true, "Stringer"},
		{anon, "", true, "nil *user"},
		{none, "", true, "nil slice Stringer"},
		{42, "", false, "int"},
	} {
		key, ok := String(c.v)
		if key != c.key || ok != c.ok {
			t.Errorf("%s: String(%#v) = %q, %v; want %q, %v", c.name, c.v, key, ok, c.key, c.ok)
		}
	}
}
