// Command kind-validate checks a kind cluster config the way the kind version pinned in
// go.mod (e2e/tools/versions.env KIND_VERSION) reads it, without Docker:
//
//   - kind and apiVersion, as kind's loader checks them;
//   - a strict decode into kind's own v1alpha4.Cluster with the decoder and options kind
//     uses (go.yaml.in/yaml/v3 with KnownFields), so a misspelt field, a wrong type or
//     a duplicated key fails;
//   - kind's v1alpha4 defaulting, then the rules of kind's internal Cluster.Validate
//     (pkg/internal/apis/config/validate.go), re-implemented here because that package
//     is internal;
//   - every patch parsed with the libraries kind applies it with: containerd patches as
//     TOML (pelletier/go-toml v1), kubeadm patches as YAML (sigs.k8s.io/yaml), JSON
//     6902 patches with evanphx/json-patch;
//   - two things kind accepts silently but that cannot be meant: a feature gate whose
//     value is not a YAML boolean, and a kubeadm patch whose kind names no object
//     kind generates (such a patch applies to nothing).
//
// It prints "ok" and exits 0, or prints one problem a line, each starting with the
// field it is about (nodes[1].role: ...), and exits 1. Usage and I/O errors exit 2.
package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"

	jsonpatch "github.com/evanphx/json-patch/v5"
	toml "github.com/pelletier/go-toml"
	yaml "go.yaml.in/yaml/v3"
	"sigs.k8s.io/kind/pkg/apis/config/v1alpha4"
	sigsyaml "sigs.k8s.io/yaml"
)

const (
	wantAPIVersion = "kind.x-k8s.io/v1alpha4"
	wantKind       = "Cluster"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: kind-validate KIND-CONFIG.yaml")
		os.Exit(2)
	}
	raw, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintf(os.Stderr, "kind-validate: %v\n", err)
		os.Exit(2)
	}
	problems := validate(raw)
	if len(problems) == 0 {
		fmt.Println("ok")
		return
	}
	for _, p := range problems {
		fmt.Println(p)
	}
	os.Exit(1)
}

// problem is one finding about one field.
type problem struct {
	path string // e.g. nodes[1].role; "" for the document as a whole
	msg  string
	line int // 0 when unknown
}

func (p problem) String() string {
	s := p.msg
	if p.path != "" {
		s = p.path + ": " + s
	}
	if p.line > 0 {
		s += fmt.Sprintf(" (line %d)", p.line)
	}
	return strings.ReplaceAll(s, "\n", " ")
}

type checker struct {
	entries  []entry
	problems []problem
	reported map[string]bool // paths that already have a problem
}

func (c *checker) add(path, msg string, line int) {
	c.problems = append(c.problems, problem{path: path, msg: msg, line: line})
	c.reported[path] = true
}

// addAt reports a problem on path, with the line path starts on when it is known.
func (c *checker) addAt(path, format string, args ...any) {
	c.add(path, fmt.Sprintf(format, args...), c.lineOf(path))
}

func validate(raw []byte) []problem {
	c := &checker{reported: map[string]bool{}}

	var doc yaml.Node
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		c.add("", "not valid YAML: "+err.Error(), 0)
		return c.problems
	}
	if len(doc.Content) > 0 {
		root := doc.Content[0]
		if root.Kind != yaml.MappingNode {
			c.add("", fmt.Sprintf("the document must be a mapping, not %s", root.ShortTag()), root.Line)
			return c.problems
		}
		index(root, "", &c.entries)
	}

	// kind's loader (pkg/internal/apis/config/encoding.Parse) first reads kind and
	// apiVersion leniently and accepts only v1alpha4 Cluster. They are read from the
	// document here, so that a duplicated key elsewhere is left to the strict decode,
	// which reports it with everything else.
	c.checkTypeMeta("apiVersion", wantAPIVersion, ", the only version kind reads")
	c.checkTypeMeta("kind", wantKind, "")
	if len(c.problems) > 0 {
		return c.problems
	}

	// Then it decodes strictly into v1alpha4.Cluster, exactly like this.
	cfg := &v1alpha4.Cluster{}
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	decodeErr := dec.Decode(cfg)
	c.checkEnums()
	aborted := false
	if decodeErr != nil {
		var te *yaml.TypeError
		if errors.As(decodeErr, &te) {
			c.decodeError(decodeErr)
		} else {
			// A custom UnmarshalYAML (Mount, PortMapping) failed and the decoder
			// stopped; checkEnums has named the field where it could.
			aborted = true
			if len(c.problems) == 0 {
				c.add("", "kind cannot decode it: "+decodeErr.Error(), 0)
			}
		}
	}
	c.checkFeatureGateValues()
	if aborted {
		return c.problems // the rest of cfg was never filled in
	}

	v1alpha4.SetDefaultsCluster(cfg)
	c.checkCluster(cfg)
	c.checkPatches(cfg)
	return c.problems
}

func (c *checker) checkTypeMeta(field, want, why string) {
	e := c.lookup(field)
	switch {
	case e == nil:
		c.add(field, fmt.Sprintf("missing, want %s%s", want, why), 0)
	case e.val.Kind != yaml.ScalarNode || e.val.ShortTag() == "!!null":
		c.add(field, fmt.Sprintf("must be the string %s, not %s", want, e.val.ShortTag()), e.key.Line)
	case e.val.Value != want:
		c.add(field, fmt.Sprintf("%q is not %s%s", e.val.Value, want, why), e.key.Line)
	}
}

// entry is one mapping value or sequence item of the document, by path.
type entry struct {
	path string
	key  *yaml.Node // nil for sequence items
	val  *yaml.Node
}

var plainKey = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_-]*$`)

func join(path, key string) string {
	if !plainKey.MatchString(key) {
		return fmt.Sprintf("%s[%s]", path, strconv.Quote(key))
	}
	if path == "" {
		return key
	}
	return path + "." + key
}

func index(n *yaml.Node, path string, out *[]entry) {
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := join(path, k.Value)
			*out = append(*out, entry{path: p, key: k, val: v})
			index(v, p, out)
		}
	case yaml.SequenceNode:
		for i, v := range n.Content {
			p := fmt.Sprintf("%s[%d]", path, i)
			*out = append(*out, entry{path: p, val: v})
			index(v, p, out)
		}
	}
}

func (c *checker) lookup(path string) *entry {
	for i := range c.entries {
		if c.entries[i].path == path {
			return &c.entries[i]
		}
	}
	return nil
}

func (c *checker) lineOf(path string) int {
	e := c.lookup(path)
	switch {
	case e == nil:
		return 0
	case e.key != nil:
		return e.key.Line
	default:
		return e.val.Line
	}
}

var (
	reUnknown  = regexp.MustCompile(`^line (\d+): field (.+) not found in type (\S+)$`)
	reType     = regexp.MustCompile(`^line (\d+): (cannot unmarshal .*) into (.+)$`)
	reDup      = regexp.MustCompile(`^line (\d+): mapping key (".*") already defined at line (\d+)$`)
	reLine     = regexp.MustCompile(`^line (\d+): (.*)$`)
	knownTypes = map[string]reflect.Type{
		"v1alpha4.Cluster":          reflect.TypeOf(v1alpha4.Cluster{}),
		"v1alpha4.TypeMeta":         reflect.TypeOf(v1alpha4.TypeMeta{}),
		"v1alpha4.Node":             reflect.TypeOf(v1alpha4.Node{}),
		"v1alpha4.Networking":       reflect.TypeOf(v1alpha4.Networking{}),
		"v1alpha4.PatchJSON6902":    reflect.TypeOf(v1alpha4.PatchJSON6902{}),
		"v1alpha4.MountAlias":       reflect.TypeOf(v1alpha4.Mount{}),
		"v1alpha4.PortMappingAlias": reflect.TypeOf(v1alpha4.PortMapping{}),
	}
)

// decodeError turns the decoder's "line N: ..." messages into problems on the field
// at that line.
func (c *checker) decodeError(err error) {
	var te *yaml.TypeError
	if !errors.As(err, &te) {
		c.add("", err.Error(), 0)
		return
	}
	for _, msg := range te.Errors {
		if m := reUnknown.FindStringSubmatch(msg); m != nil {
			line, _ := strconv.Atoi(m[1])
			path := c.find(line, func(e entry) bool { return e.key != nil && e.key.Line == line && e.key.Value == m[2] })
			if path == "" {
				path = m[2]
			}
			text := fmt.Sprintf("unknown field, %s has no %q", m[3], m[2])
			if s := suggest(m[2], knownTypes[m[3]]); s != "" {
				text += fmt.Sprintf(" (did you mean %q?)", s)
			}
			c.add(path, text, line)
			continue
		}
		if m := reType.FindStringSubmatch(msg); m != nil {
			line, _ := strconv.Atoi(m[1])
			path := c.find(line, func(e entry) bool { return e.val.Line == line && "cannot unmarshal "+render(e.val) == m[2] })
			c.add(path, fmt.Sprintf("%s into %s", m[2], m[3]), line)
			continue
		}
		if m := reDup.FindStringSubmatch(msg); m != nil {
			line, _ := strconv.Atoi(m[1])
			key, _ := strconv.Unquote(m[2])
			path := c.find(line, func(e entry) bool { return e.key != nil && e.key.Line == line && e.key.Value == key })
			c.add(path, fmt.Sprintf("duplicate key, already defined at line %s", m[3]), line)
			continue
		}
		if m := reLine.FindStringSubmatch(msg); m != nil {
			line, _ := strconv.Atoi(m[1])
			c.add(c.find(line, func(e entry) bool { return e.val.Line == line }), m[2], line)
			continue
		}
		c.add("", msg, 0)
	}
}

// find returns the path of the deepest entry that match accepts.
func (c *checker) find(line int, match func(entry) bool) string {
	path := ""
	for _, e := range c.entries {
		if match(e) {
			path = e.path
		}
	}
	if path == "" {
		for _, e := range c.entries {
			if e.val.Line == line || (e.key != nil && e.key.Line == line) {
				path = e.path
			}
		}
	}
	return path
}

// render mirrors how yaml.v3's decoder names a value in "cannot unmarshal" errors.
func render(n *yaml.Node) string {
	tag := n.ShortTag()
	if n.Kind == yaml.MappingNode || n.Kind == yaml.SequenceNode {
		return tag
	}
	if len(n.Value) > 10 {
		return tag + " `" + n.Value[:7] + "...`"
	}
	return tag + " `" + n.Value + "`"
}

// yamlFields lists the field names t accepts, inline structs included.
func yamlFields(t reflect.Type) []string {
	var names []string
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := f.Tag.Get("yaml")
		name, opts, _ := strings.Cut(tag, ",")
		if strings.Contains(opts, "inline") {
			names = append(names, yamlFields(f.Type)...)
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		if name != "-" {
			names = append(names, name)
		}
	}
	return names
}

// suggest returns the field of t closest to name, if it is close.
func suggest(name string, t reflect.Type) string {
	if t == nil {
		return ""
	}
	best, bestDist := "", 3
	for _, f := range yamlFields(t) {
		d := distance(strings.ToLower(name), strings.ToLower(f))
		if d < bestDist {
			best, bestDist = f, d
		}
	}
	return best
}

func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

var (
	reMountPropagation = regexp.MustCompile(`^nodes\[\d+\]\.extraMounts\[\d+\]\.propagation$`)
	rePortProtocol     = regexp.MustCompile(`^nodes\[\d+\]\.extraPortMappings\[\d+\]\.protocol$`)
)

// checkEnums repeats the checks of kind's custom UnmarshalYAML methods (v1alpha4/yaml.go),
// whose errors stop the decoder without saying where.
func (c *checker) checkEnums() {
	for _, e := range c.entries {
		if e.val.Kind != yaml.ScalarNode {
			continue
		}
		switch {
		case reMountPropagation.MatchString(e.path):
			switch v1alpha4.MountPropagation(e.val.Value) {
			case "", v1alpha4.MountPropagationNone, v1alpha4.MountPropagationHostToContainer, v1alpha4.MountPropagationBidirectional:
			default:
				c.add(e.path, fmt.Sprintf("%q is not one of None, HostToContainer, Bidirectional", e.val.Value), e.key.Line)
			}
		case rePortProtocol.MatchString(e.path):
			switch v1alpha4.PortMappingProtocol(strings.ToUpper(e.val.Value)) {
			case "", v1alpha4.PortMappingProtocolTCP, v1alpha4.PortMappingProtocolUDP, v1alpha4.PortMappingProtocolSCTP:
			default:
				c.add(e.path, fmt.Sprintf("%q is not one of TCP, UDP, SCTP", e.val.Value), e.key.Line)
			}
		}
	}
}

// checkFeatureGateValues wants every feature gate to be a YAML boolean. kind's decoder
// also takes yes/no/on/off (quoted or not) for a bool; a gate written that way is
// ambiguous across YAML readers, so it is refused here.
func (c *checker) checkFeatureGateValues() {
	gates := c.lookup("featureGates")
	if gates == nil || gates.val.Kind != yaml.MappingNode {
		return
	}
	for i := 1; i < len(gates.val.Content); i += 2 {
		k, v := gates.val.Content[i-1], gates.val.Content[i]
		path := join("featureGates", k.Value)
		if c.reported[path] || v.ShortTag() == "!!bool" {
			continue
		}
		shown := v.Value
		if v.Kind == yaml.ScalarNode && v.Style&(yaml.DoubleQuotedStyle|yaml.SingleQuotedStyle) != 0 {
			shown = strconv.Quote(v.Value)
		}
		c.add(path, fmt.Sprintf("%s is %s, not a boolean: write true or false", shown, v.ShortTag()), k.Line)
	}
}

// checkCluster mirrors kind's Cluster.Validate and Node.Validate.
func (c *checker) checkCluster(cfg *v1alpha4.Cluster) {
	// The name is overridden by `kind create cluster --name`; kind validates the
	// result, so only a name written in the file is checked.
	if cfg.Name != "" && !validName.MatchString(cfg.Name) {
		c.addAt("name", "%q is not a valid cluster name, it must match %s", cfg.Name, validName)
	}
	nw := cfg.Networking
	if nw.APIServerPort != 0 {
		if err := validatePort(nw.APIServerPort); err != nil {
			c.addAt("networking.apiServerPort", "%v", err)
		}
	}
	switch nw.IPFamily {
	case v1alpha4.IPv4Family, v1alpha4.IPv6Family, v1alpha4.DualStackFamily:
		if err := validateSubnets(nw.PodSubnet, nw.IPFamily); err != nil {
			c.addAt("networking.podSubnet", "%q: %v", nw.PodSubnet, err)
		}
		if err := validateSubnets(nw.ServiceSubnet, nw.IPFamily); err != nil {
			c.addAt("networking.serviceSubnet", "%q: %v", nw.ServiceSubnet, err)
		}
	default:
		c.addAt("networking.ipFamily", "%q is not one of ipv4, ipv6, dual", nw.IPFamily)
	}
	switch nw.KubeProxyMode {
	case v1alpha4.IPTablesProxyMode, v1alpha4.IPVSProxyMode, v1alpha4.NFTablesProxyMode, "none":
	default:
		c.addAt("networking.kubeProxyMode", "%q is not one of iptables, ipvs, nftables, none", nw.KubeProxyMode)
	}

	controlPlanes := 0
	for i, n := range cfg.Nodes {
		path := fmt.Sprintf("nodes[%d]", i)
		switch n.Role {
		case v1alpha4.ControlPlaneRole:
			controlPlanes++
		case v1alpha4.WorkerRole:
		default:
			c.addAt(path+".role", "%q is not one of %s, %s", n.Role, v1alpha4.ControlPlaneRole, v1alpha4.WorkerRole)
		}
		if n.Image == "" {
			c.addAt(path+".image", "is required")
		}
		for j, m := range n.ExtraPortMappings {
			mp := fmt.Sprintf("%s.extraPortMappings[%d]", path, j)
			if err := validatePort(m.HostPort); err != nil {
				c.addAt(mp+".hostPort", "%v", err)
			}
			if err := validatePort(m.ContainerPort); err != nil {
				c.addAt(mp+".containerPort", "%v", err)
			}
		}
		if err := validatePortMappings(n.ExtraPortMappings); err != nil {
			c.addAt(path+".extraPortMappings", "%v", err)
		}
	}
	if controlPlanes < 1 {
		c.addAt("nodes", "must have at least one %s node", v1alpha4.ControlPlaneRole)
	}
}

var validName = regexp.MustCompile(`^[a-z0-9.-]+$`)

func validatePort(port int32) error {
	// -1 lets the container backend pick the port.
	if port < -1 || port > 65535 {
		return fmt.Errorf("invalid port number: %d", port)
	}
	return nil
}

func validatePortMappings(mappings []v1alpha4.PortMapping) error {
	wildcard := net.ParseIP("0.0.0.0")
	bound := map[string]map[string]bool{} // "port/protocol" -> listen addresses
	for _, m := range mappings {
		if m.HostPort == -1 || m.HostPort == 0 {
			continue // random ports never clash
		}
		addr := net.ParseIP(m.ListenAddress)
		if m.ListenAddress == "" {
			addr = wildcard
		}
		if addr == nil {
			return fmt.Errorf("invalid listen address: %s", m.ListenAddress)
		}
		portProtocol := fmt.Sprintf("%d/%s", m.HostPort, m.Protocol)
		clash := fmt.Errorf("port mapping with same listen address, port and protocol already configured: %s:%s", addr, portProtocol)
		if addr.Equal(net.ParseIP("::")) {
			addr = wildcard
		}
		a := addr.String()
		if seen, ok := bound[portProtocol]; ok {
			if (addr.Equal(wildcard) && len(seen) > 0) || seen[a] || seen[wildcard.String()] {
				return clash
			}
		} else {
			bound[portProtocol] = map[string]bool{}
		}
		bound[portProtocol][a] = true
	}
	return nil
}

func validateSubnets(subnets string, family v1alpha4.ClusterIPFamily) error {
	var cidrs []*net.IPNet
	for _, s := range strings.Split(subnets, ",") {
		_, cidr, err := net.ParseCIDR(s)
		if err != nil {
			return fmt.Errorf("failed to parse cidr value %q: %v", s, err)
		}
		cidrs = append(cidrs, cidr)
	}
	dual := family == v1alpha4.DualStackFamily
	switch {
	case dual && len(cidrs) > 2:
		return errors.New("expected one (IPv4 or IPv6) CIDR or two CIDRs from each family for dual-stack networking")
	case dual && len(cidrs) == 2:
		if (cidrs[0].IP.To4() == nil) == (cidrs[1].IP.To4() == nil) {
			return errors.New("expected one (IPv4 or IPv6) CIDR or two CIDRs from each family for dual-stack networking")
		}
	case !dual && len(cidrs) > 1:
		return errors.New("only one CIDR allowed for single-stack networking")
	case family == v1alpha4.IPv4Family && cidrs[0].IP.To4() == nil:
		return errors.New("expected IPv4 CIDR for IPv4 family")
	case family == v1alpha4.IPv6Family && cidrs[0].IP.To4() != nil:
		return errors.New("expected IPv6 CIDR for IPv6 family")
	}
	return nil
}

// kubeadmKinds are the objects kind's kubeadm config template generates; a kubeadm
// merge patch is applied only to the object whose kind it names.
var kubeadmKinds = []string{
	"ClusterConfiguration", "InitConfiguration", "JoinConfiguration",
	"KubeletConfiguration", "KubeProxyConfiguration",
}

// checkPatches parses every patch the way kind applies it (pkg/internal/patch).
func (c *checker) checkPatches(cfg *v1alpha4.Cluster) {
	for i, p := range cfg.ContainerdConfigPatches {
		path := fmt.Sprintf("containerdConfigPatches[%d]", i)
		if _, err := toml.LoadBytes([]byte(p)); err != nil {
			c.addAt(path, "not valid TOML: %v", err)
			continue
		}
		// kind reads the patch's version to decide whether it applies.
		var v struct {
			Version int `toml:"version,omitempty"`
		}
		if err := toml.Unmarshal([]byte(p), &v); err != nil {
			c.addAt(path, "version: %v", err)
		}
	}
	for i, p := range cfg.ContainerdConfigPatchesJSON6902 {
		if _, err := jsonpatch.DecodePatch([]byte(p)); err != nil {
			c.addAt(fmt.Sprintf("containerdConfigPatchesJSON6902[%d]", i), "not a JSON 6902 patch: %v", err)
		}
	}
	c.checkKubeadmPatches("", cfg.KubeadmConfigPatches, cfg.KubeadmConfigPatchesJSON6902)
	for i, n := range cfg.Nodes {
		c.checkKubeadmPatches(fmt.Sprintf("nodes[%d].", i), n.KubeadmConfigPatches, n.KubeadmConfigPatchesJSON6902)
	}
}

func (c *checker) checkKubeadmPatches(prefix string, patches []string, patches6902 []v1alpha4.PatchJSON6902) {
	for i, p := range patches {
		path := fmt.Sprintf("%skubeadmConfigPatches[%d]", prefix, i)
		docs, err := splitYAMLDocuments(p)
		if err != nil {
			c.addAt(path, "%v", err)
			continue
		}
		for d, doc := range docs {
			where := path
			if len(docs) > 1 {
				where = fmt.Sprintf("%s (document %d)", path, d+1)
			}
			var mi struct {
				Kind       string `json:"kind,omitempty"`
				APIVersion string `json:"apiVersion,omitempty"`
			}
			if err := sigsyaml.Unmarshal([]byte(doc), &mi); err != nil {
				c.add(where, "not valid YAML: "+err.Error(), c.lineOf(path))
				continue
			}
			if _, err := sigsyaml.YAMLToJSON([]byte(doc)); err != nil {
				c.add(where, "not valid YAML: "+err.Error(), c.lineOf(path))
				continue
			}
			if strings.TrimSpace(doc) != "" {
				c.checkKubeadmKind(where, c.lineOf(path), mi.Kind)
			}
		}
	}
	for i, p := range patches6902 {
		path := fmt.Sprintf("%skubeadmConfigPatchesJSON6902[%d]", prefix, i)
		c.checkKubeadmKind(path+".kind", c.lineOf(path), p.Kind)
		j, err := sigsyaml.YAMLToJSON([]byte(p.Patch))
		if err == nil {
			_, err = jsonpatch.DecodePatch(j)
		}
		if err != nil {
			c.addAt(path+".patch", "not a JSON 6902 patch: %v", err)
		}
	}
}

func (c *checker) checkKubeadmKind(path string, line int, kind string) {
	for _, k := range kubeadmKinds {
		if kind == k {
			return
		}
	}
	sorted := append([]string(nil), kubeadmKinds...)
	sort.Strings(sorted)
	what := fmt.Sprintf("kind %q is", kind)
	switch {
	case kind == "":
		what = "has no kind, which is"
	case strings.HasSuffix(path, ".kind"):
		what = fmt.Sprintf("%q is", kind)
	}
	c.add(path, fmt.Sprintf("%s none of %s, so kind applies the patch to nothing", what, strings.Join(sorted, ", ")), line)
}

// splitYAMLDocuments splits a patch into documents as kind does (on "\n---" lines).
func splitYAMLDocuments(stream string) ([]string, error) {
	var docs []string
	scanner := bufio.NewScanner(strings.NewReader(stream))
	scanner.Split(splitYAMLDocument)
	for scanner.Scan() {
		docs = append(docs, scanner.Text())
	}
	if err := scanner.Err(); err != nil {
		return nil, fmt.Errorf("error splitting documents: %w", err)
	}
	return docs, nil
}

const yamlSeparator = "\n---"

func splitYAMLDocument(data []byte, atEOF bool) (advance int, token []byte, err error) {
	if atEOF && len(data) == 0 {
		return 0, nil, nil
	}
	sep := len(yamlSeparator)
	if i := bytes.Index(data, []byte(yamlSeparator)); i >= 0 {
		i += sep
		after := data[i:]
		if len(after) == 0 {
			if atEOF {
				return len(data), data[:len(data)-sep], nil
			}
			return 0, nil, nil
		}
		if j := bytes.IndexByte(after, '\n'); j >= 0 {
			return i + j + 1, data[0 : i-sep], nil
		}
		return 0, nil, nil
	}
	if atEOF {
		return len(data), data, nil
	}
	return 0, nil, nil
}
