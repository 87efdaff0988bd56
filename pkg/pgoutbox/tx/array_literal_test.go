package tx

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"
)

// Slices become array literals, quoted and escaped, NULLs unquoted; other
// arguments stay as they are.
func TestWithArrayLiterals(t *testing.T) {
	at := time.Date(2026, 12, 4, 17, 0, 0, 5000, time.UTC)
	id := uuid.MustParse("0b4c4d5e-0000-4000-8000-000000000001")
	args := []any{
		"topic",
		[]byte{1, 2},
		[]string{`plain`, `with "quotes"`, `back\slash`, `née`, ``},
		[][]byte{{0, 0xff}, nil, {}},
		[]int64{1, -2},
		[]pgtype.Int8{{Int64: 7, Valid: true}, {}},
		[]*string{nil, new("x")},
		[]time.Time{at},
		[]uuid.UUID{id},
		[]bool{true},
		[]int64(nil),
		[]time.Time{at.In(time.FixedZone("LMT", 5*3600+30*60+17))},
	}
	got, ok := withArrayLiterals(args)
	require.True(t, ok)
	require.Equal(t, []any{
		"topic",
		[]byte{1, 2},
		`{"plain","with \"quotes\"","back\\slash","née",""}`,
		`{"\\x00ff",NULL,"\\x"}`,
		`{"1","-2"}`,
		`{"7",NULL}`,
		`{NULL,"x"}`,
		`{"2026-12-04T17:00:00.000005Z"}`,
		`{"0b4c4d5e-0000-4000-8000-000000000001"}`,
		`{"true"}`,
		nil, // a nil slice is NULL, not '{}'
		`{"2026-12-04T17:00:00.000005Z"}`,
	}, got)

	_, ok = withArrayLiterals([]any{"no slices", 1})
	require.False(t, ok, "nothing to replace: the driver's error stands")
	_, ok = withArrayLiterals([]any{[]struct{}{{}}})
	require.False(t, ok, "an element with no text form: the driver's error stands")
}
