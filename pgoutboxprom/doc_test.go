package pgoutboxprom_test

import (
	"os"
	"regexp"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pgoutboxprom"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// recorder is a Registerer that keeps what is registered on it.
type recorder struct{ collectors []prometheus.Collector }

func (r *recorder) Register(c prometheus.Collector) error {
	r.collectors = append(r.collectors, c)
	return nil
}
func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	r.collectors = append(r.collectors, cs...)
}
func (r *recorder) Unregister(prometheus.Collector) bool { return false }

var fqNameRE = regexp.MustCompile(`fqName: "([a-z_]+)"`)

// The package doc lists every metric, and nothing else: a metric added
// without its line (or a line left behind) fails here.
func TestPackageDocListsEveryMetric(t *testing.T) {
	t.Parallel()
	rec := &recorder{}
	_, err := pgoutboxprom.NewObserver(rec, pgoutboxprom.Options{})
	require.NoError(t, err)
	rec.MustRegister(pgoutboxprom.NewCollector(tx.FromSQLDB(nil), schema.Config{}, pgoutboxprom.Options{}))
	var registered []string
	for _, c := range rec.collectors {
		ch := make(chan *prometheus.Desc, 16)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			m := fqNameRE.FindStringSubmatch(d.String())
			require.NotNil(t, m, d.String())
			registered = append(registered, m[1])
		}
	}
	doc, err := os.ReadFile("doc.go")
	require.NoError(t, err)
	var documented []string
	for _, m := range regexp.MustCompile(`(?m)^//\t(pgoutbox_[a-z_]+)`).FindAllStringSubmatch(string(doc), -1) {
		documented = append(documented, m[1])
	}
	slices.Sort(registered)
	slices.Sort(documented)
	require.Equal(t, registered, documented)
}
