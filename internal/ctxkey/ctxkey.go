// Package ctxkey turns a value found in a request's context into a
// rate-limit key: the one rule of httplimit's and grpclimit's FromContext.
package ctxkey

import (
	"fmt"
	"reflect"
)

// String returns v as a key: "" when v is missing, nil or a nil pointer
// (an authentication layer that stores a nil *User for anonymous callers:
// the rule is skipped, as for no value, and v.String() is never called on
// it, which would panic, and in a gRPC interceptor take the server down);
// v itself for a string; v.String() for a fmt.Stringer. ok is false for
// any other type.
func String(v any) (key string, ok bool) {
	switch v := v.(type) {
	case nil:
		return "", true
	case string:
		return v, true
	case fmt.Stringer:
		if rv := reflect.ValueOf(v); nilable(rv.Kind()) && rv.IsNil() {
			return "", true
		}
		return v.String(), true
	}
	return "", false
}

func nilable(k reflect.Kind) bool {
	switch k {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan, reflect.Interface, reflect.UnsafePointer:
		return true
	}
	return false
}
