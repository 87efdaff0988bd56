package tx

import (
	"database/sql/driver"
	"encoding/hex"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// pgoutbox passes arrays as Go slices ([]string, [][]byte, []int64, ...),
// which the pgx stdlib driver and lib/pq from v1.11 on encode themselves.
// Other drivers (lib/pq before v1.11, bun's pgdriver) leave them to
// database/sql's default conversion, which refuses them before anything
// reaches the server. For those, the statement runs again with each slice
// written as a PostgreSQL array literal: every array parameter of
// pgoutbox's statements is cast (or compared) to its array type, so the
// server parses the text as it would the driver's encoding.

// refusedArgument reports whether err is database/sql's refusal of an
// argument its driver cannot take (the statement was not executed).
func refusedArgument(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "sql: converting argument")
}

// withArrayLiterals returns args with each slice (but []byte) replaced by
// its array literal (a nil slice by NULL), and whether any was replaced
// and every one could be.
func withArrayLiterals(args []any) ([]any, bool) {
	out := make([]any, len(args))
	replaced := false
	for i, a := range args {
		out[i] = a
		v := reflect.ValueOf(a)
		if !v.IsValid() || v.Kind() != reflect.Slice || v.Type().Elem().Kind() == reflect.Uint8 {
			continue
		}
		if v.IsNil() {
			// NULL, as pgx and lib/pq from v1.11 send a nil slice, not
			// '{}': RequeueParked's "any id" is a NULL bigint[].
			out[i], replaced = nil, true
			continue
		}
		lit, ok := arrayLiteral(v)
		if !ok {
			return nil, false
		}
		out[i], replaced = lit, true
	}
	return out, replaced
}

// arrayLiteral writes a one-dimensional slice as '{"a","b",NULL}'. Every
// element is quoted, numbers too (the array input accepts them so), and
// []byte elements are bytea's hex form.
func arrayLiteral(v reflect.Value) (string, bool) {
	var b strings.Builder
	b.WriteByte('{')
	for i := range v.Len() {
		if i > 0 {
			b.WriteByte(',')
		}
		s, null, ok := elementText(v.Index(i).Interface())
		switch {
		case !ok:
			return "", false
		case null:
			b.WriteString("NULL")
		default:
			b.WriteByte('"')
			for _, r := range s {
				if r == '"' || r == '\\' {
					b.WriteByte('\\')
				}
				b.WriteRune(r)
			}
			b.WriteByte('"')
		}
	}
	b.WriteByte('}')
	return b.String(), true
}

// elementText is an array element's text form, or null.
func elementText(e any) (text string, null, ok bool) {
	if val, isValuer := e.(driver.Valuer); isValuer {
		if rv := reflect.ValueOf(e); rv.Kind() == reflect.Pointer && rv.IsNil() {
			return "", true, true
		}
		dv, err := val.Value()
		if err != nil {
			return "", false, false
		}
		e = dv
	}
	switch x := e.(type) {
	case nil:
		return "", true, true
	case string:
		return x, false, true
	case []byte:
		if x == nil {
			return "", true, true
		}
		return `\x` + hex.EncodeToString(x), false, true
	case bool:
		return strconv.FormatBool(x), false, true
	case time.Time:
		// UTC: RFC 3339 drops the seconds of an offset (see DeliverAt).
		return x.UTC().Format(time.RFC3339Nano), false, true
	}
	v := reflect.ValueOf(e)
	switch v.Kind() {
	case reflect.Pointer:
		if v.IsNil() {
			return "", true, true
		}
		return elementText(v.Elem().Interface())
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return strconv.FormatInt(v.Int(), 10), false, true
	case reflect.Uint, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return strconv.FormatUint(v.Uint(), 10), false, true
	case reflect.Float32, reflect.Float64:
		return strconv.FormatFloat(v.Float(), 'g', -1, v.Type().Bits()), false, true
	case reflect.String:
		return v.String(), false, true
	}
	return "", false, false
}
