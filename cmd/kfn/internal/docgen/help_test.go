package main

import (
	"reflect"
	"testing"
)

func TestAPageIsReadBackIntoItsSections(t *testing.T) {
	p, err := parsePage(`usage: kfn x A [flags]
       kfn x B

First paragraph,
on two lines.

  an indented line

commands:
  one  the first
  two  the second

examples:
  kfn x A

  # comment
  kfn x B \
      --more

flags (a variable in brackets sets the flag from the environment):
  -kafka-brokers list
    	Kafka bootstrap brokers, host:port[,host:port…] [KFN_KAFKA_BROKERS]
  -kafka-ca string
    	PEM file (default: the system's) [KFN_KAFKA_CA]
  -lease-bucket string
    	NATS KV bucket [KFN_LEASE_BUCKET] (default "kfn_leases")
  -effects-sql SQL
    	SQL returning the effects (default: the inbox is the evidence)
  -v	show the logs
`)
	if err != nil {
		t.Fatal(err)
	}
	want := &page{
		usage:    []string{"kfn x A [flags]", "kfn x B"},
		text:     []string{"First paragraph,\non two lines.", "  an indented line"},
		commands: []entry{{"one", "the first"}, {"two", "the second"}},
		examples: []string{"kfn x A", "", "# comment", "kfn x B \\", "    --more"},
		flags: []flagDoc{
			{name: "kafka-brokers", typ: "list", usage: "Kafka bootstrap brokers, host:port[,host:port…]", env: "KFN_KAFKA_BROKERS"},
			{name: "kafka-ca", typ: "string", usage: "PEM file (default: the system's)", env: "KFN_KAFKA_CA"},
			{name: "lease-bucket", typ: "string", usage: "NATS KV bucket", env: "KFN_LEASE_BUCKET", def: `"kfn_leases"`},
			{name: "effects-sql", typ: "SQL", usage: "SQL returning the effects (default: the inbox is the evidence)"},
			{name: "v", usage: "show the logs"},
		},
	}
	if !reflect.DeepEqual(p, want) {
		t.Errorf("got  %+v\nwant %+v", p, want)
	}
}

func TestAPageThatIsNotInTheHelpShapeIsAnError(t *testing.T) {
	for _, text := range []string{
		"Usage of kfn x:\n  -a\n",
		"usage: kfn x\n\nflags (a variable in brackets sets the flag from the environment):\n  a stray line\n",
		"usage: kfn x\n\ncommands:\n  nosummary\n",
	} {
		if _, err := parsePage(text); err == nil {
			t.Errorf("%q was read without an error", text)
		}
	}
}
