package httplimit

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
)

// member is one member of a structured-field List whose items are
// sf-strings with parameters: all that the RateLimit fields hold.
type member struct {
	name   string
	params map[string]any // int64 or bool
	keys   []string       // parameter keys in order
}

func (m member) int(key string) (int64, bool) {
	v, ok := m.params[key].(int64)
	return v, ok
}

// parseList parses a List of sf-string Items with Integer or Boolean
// parameters strictly, as RFC 9651 section 4.2 does: anything else, such as
// a token item, a trailing comma, a duplicate parameter, an uppercase key
// or an unescaped quote, is an error.
func parseList(s string) ([]member, error) {
	p := &sfParser{s: strings.Trim(s, " ")}
	var list []member
	for {
		m, err := p.item()
		if err != nil {
			return nil, err
		}
		list = append(list, m)
		p.skip(" \t")
		if p.done() {
			return list, nil
		}
		if p.s[p.i] != ',' {
			return nil, p.errorf("want ','")
		}
		p.i++
		p.skip(" \t")
		if p.done() {
			return nil, p.errorf("trailing comma")
		}
	}
}

type sfParser struct {
	s string
	i int
}

func (p *sfParser) done() bool { return p.i >= len(p.s) }

func (p *sfParser) errorf(format string, args ...any) error {
	return fmt.Errorf("at %d of %q: %s", p.i, p.s, fmt.Sprintf(format, args...))
}

func (p *sfParser) skip(set string) {
	for !p.done() && strings.IndexByte(set, p.s[p.i]) >= 0 {
		p.i++
	}
}

func (p *sfParser) item() (member, error) {
	name, err := p.str()
	if err != nil {
		return member{}, err
	}
	m := member{name: name, params: map[string]any{}}
	for !p.done() && p.s[p.i] == ';' {
		p.i++
		p.skip(" ")
		key, err := p.key()
		if err != nil {
			return member{}, err
		}
		var v any = true
		if !p.done() && p.s[p.i] == '=' {
			p.i++
			if v, err = p.bare(); err != nil {
				return member{}, err
			}
		}
		if _, dup := m.params[key]; dup {
			// RFC 9651 overwrites; the middleware never repeats one.
			return member{}, p.errorf("parameter %q twice", key)
		}
		m.params[key] = v
		m.keys = append(m.keys, key)
	}
	return m, nil
}

func (p *sfParser) str() (string, error) {
	if p.done() || p.s[p.i] != '"' {
		return "", p.errorf("want a string")
	}
	p.i++
	var b strings.Builder
	for !p.done() {
		c := p.s[p.i]
		p.i++
		switch {
		case c == '\\':
			if p.done() || (p.s[p.i] != '"' && p.s[p.i] != '\\') {
				return "", p.errorf("bad escape")
			}
			b.WriteByte(p.s[p.i])
			p.i++
		case c == '"':
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", p.errorf("byte %#x in a string", c)
		default:
			b.WriteByte(c)
		}
	}
	return "", p.errorf("unterminated string")
}

func (p *sfParser) key() (string, error) {
	start := p.i
	if p.done() || !(p.s[p.i] >= 'a' && p.s[p.i] <= 'z' || p.s[p.i] == '*') {
		return "", p.errorf("want a key")
	}
	for !p.done() {
		c := p.s[p.i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || strings.IndexByte("_-.*", c) >= 0) {
			break
		}
		p.i++
	}
	return p.s[start:p.i], nil
}

// bare parses an Integer or a Boolean, the only bare items the
// middleware puts in parameters.
func (p *sfParser) bare() (any, error) {
	if strings.HasPrefix(p.s[p.i:], "?1") || strings.HasPrefix(p.s[p.i:], "?0") {
		v := p.s[p.i+1] == '1'
		p.i += 2
		return v, nil
	}
	start := p.i
	if !p.done() && p.s[p.i] == '-' {
		p.i++
	}
	digits := p.i
	for !p.done() && p.s[p.i] >= '0' && p.s[p.i] <= '9' {
		p.i++
	}
	if n := p.i - digits; n == 0 || n > 15 {
		return nil, p.errorf("want an integer of 1 to 15 digits")
	}
	if !p.done() && p.s[p.i] == '.' {
		return nil, p.errorf("decimal where an integer belongs")
	}
	return strconv.ParseInt(p.s[start:p.i], 10, 64)
}

func TestParseList(t *testing.T) {
	good := []string{
		`"default";q=100;w=60`,
		`"a";r=0;t=1, "b";r=5;t=0;hl-degraded`,
		`"we\"ird\\";q=1`,
		` "x";r=1 ,"y";r=2 `,
	}
	for _, s := range good {
		if _, err := parseList(s); err != nil {
			t.Errorf("parseList(%q) = %v; want nil", s, err)
		}
	}
	bad := []string{
		``, `default;q=1`, `"a";q=1,`, `"a";Q=1`, `"a";q=1.5`, `"a";q=1234567890123456`,
		`"a";q=1;q=2`, `"a\x"`, `"a`, `"a" "b"`, `"a";q=`, "\"a\tb\"",
	}
	for _, s := range bad {
		if l, err := parseList(s); err == nil {
			t.Errorf("parseList(%q) = %+v, nil; want an error", s, l)
		}
	}
}

// checkFields parses the RateLimit-Policy and RateLimit fields of h
// strictly and checks that they name the same policies in the same order,
// with q, w and r present. It returns the RateLimit members.
func checkFields(t *testing.T, policy, limit []string) (pol, lim []member) {
	t.Helper()
	var err error
	if pol, err = parseList(strings.Join(policy, ", ")); err != nil {
		t.Fatalf("RateLimit-Policy %q: %v", policy, err)
	}
	if lim, err = parseList(strings.Join(limit, ", ")); err != nil {
		t.Fatalf("RateLimit %q: %v", limit, err)
	}
	if len(pol) != len(lim) {
		t.Fatalf("RateLimit-Policy %q and RateLimit %q have different lengths", policy, limit)
	}
	for i := range pol {
		if pol[i].name != lim[i].name {
			t.Errorf("member %d: policy %q, limit %q; want the same", i, pol[i].name, lim[i].name)
		}
		q, okq := pol[i].int("q")
		w, okw := pol[i].int("w")
		r, okr := lim[i].int("r")
		tt, okt := lim[i].int("t")
		if !okq || !okw || !okr || !okt || q < 0 || w < 1 || r < 0 || tt < 0 || r > q {
			t.Errorf("member %d: %+v / %+v; want q >= r >= 0, w >= 1, t >= 0", i, pol[i], lim[i])
		}
	}
	return pol, lim
}
